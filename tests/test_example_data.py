"""Tests for the example's tokenizer, batch sampler and model (single process, no process group)."""

from __future__ import annotations

import pytest
import torch

from examples.data import CharTokenizer, batch_seed, load_corpus, sample_batch
from fsdp.plan.gpt import GPT, PRESETS, Block, GPTConfig


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus: str) -> CharTokenizer:
    return CharTokenizer(corpus)


@pytest.fixture(scope="module")
def data(corpus: str, tokenizer: CharTokenizer) -> torch.Tensor:
    return tokenizer.encode_tensor(corpus)


def _tiny_config(vocab_size: int = 50, block_size: int = 16) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, d_model=32)


# --- corpus and tokenizer ---------------------------------------------------------------------


def test_corpus_is_shipped_and_sized(corpus: str) -> None:
    assert 100_000 <= len(corpus.encode("utf-8")) <= 300_000
    assert "Shall I compare thee to a summer's day?" in corpus


def test_tokenizer_round_trip(corpus: str, tokenizer: CharTokenizer) -> None:
    ids = tokenizer.encode(corpus)
    assert len(ids) == len(corpus)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == corpus
    assert tokenizer.decode(tokenizer.encode_tensor(corpus)) == corpus
    sample = "To be, or not to be: that is the question."
    assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_tokenizer_vocabulary(corpus: str, tokenizer: CharTokenizer) -> None:
    assert tokenizer.chars == sorted(set(corpus))
    assert tokenizer.vocab_size == len(set(corpus))
    assert tokenizer.encode_tensor("ab").dtype == torch.long


def test_tokenizer_rejects_unknown_characters(tokenizer: CharTokenizer) -> None:
    with pytest.raises(KeyError):
        tokenizer.encode("\u2603")
    with pytest.raises(ValueError):
        CharTokenizer("")


# --- batch sampling ---------------------------------------------------------------------------


def test_batch_shapes_and_shift(data: torch.Tensor) -> None:
    x, y = sample_batch(data, 4, 32, seed=0, rank=0, step=0)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.long
    # targets are the inputs shifted by one token
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a contiguous window of the corpus
    for row_x, row_y in zip(x, y):
        window = torch.cat([row_x, row_y[-1:]])
        starts = (data[: data.numel() - 32] == window[0]).nonzero().flatten()
        assert any(torch.equal(data[s : s + 33], window) for s in starts.tolist())


def test_batches_are_deterministic(data: torch.Tensor) -> None:
    a = sample_batch(data, 8, 16, seed=3, rank=1, step=7)
    b = sample_batch(data, 8, 16, seed=3, rank=1, step=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batches_differ_across_ranks_steps_and_seeds(data: torch.Tensor) -> None:
    batches = {
        (seed, rank, step): sample_batch(data, 8, 16, seed=seed, rank=rank, step=step)[0]
        for seed in (0, 1)
        for rank in range(4)
        for step in range(3)
    }
    keys = list(batches)
    for i, k1 in enumerate(keys):
        for k2 in keys[i + 1 :]:
            assert not torch.equal(batches[k1], batches[k2]), (k1, k2)
    # a sum of seed + rank + step would collide here; the derived seeds must not
    assert batch_seed(0, 1, 0) != batch_seed(0, 0, 1)
    assert batch_seed(1, 0, 0) != batch_seed(0, 1, 0)


def test_sample_batch_validates_arguments(data: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        sample_batch(data.view(1, -1), 2, 8, seed=0, rank=0, step=0)
    with pytest.raises(ValueError):
        sample_batch(data[:8], 2, 8, seed=0, rank=0, step=0)
    with pytest.raises(ValueError):
        sample_batch(data, 0, 8, seed=0, rank=0, step=0)


# --- model ------------------------------------------------------------------------------------


def test_forward_shapes() -> None:
    torch.manual_seed(0)
    config = _tiny_config(vocab_size=50, block_size=16)
    model = GPT(config)
    for t in (1, 7, 16):
        logits = model(torch.randint(0, 50, (3, t)))
        assert logits.shape == (3, t, 50)
        assert torch.isfinite(logits).all()


def test_model_structure() -> None:
    config = _tiny_config()
    model = GPT(config)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == config.n_layer
    # the output head is not tied to the token embedding
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    assert model.head.bias is None
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_forward_rejects_too_long_sequences() -> None:
    model = GPT(_tiny_config(block_size=8))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_causal_masking() -> None:
    """Changing the token at position p leaves the logits at positions < p unchanged."""
    torch.manual_seed(0)
    config = _tiny_config(vocab_size=50, block_size=16)
    model = GPT(config).eval()
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        base = model(idx)
        for p in (0, 5, 15):
            changed = idx.clone()
            changed[:, p] = (changed[:, p] + 1) % 50
            out = model(changed)
            torch.testing.assert_close(out[:, :p], base[:, :p], rtol=0, atol=1e-6)
            # ...and the change is visible from position p on
            assert not torch.allclose(out[:, p:], base[:, p:])


def test_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    model = GPT(_tiny_config())
    model(torch.randint(0, 50, (2, 16))).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name


def test_presets_and_config_validation() -> None:
    for name, (n_layer, n_head, d_model) in PRESETS.items():
        config = GPTConfig.from_preset(name, vocab_size=74, block_size=64)
        assert (config.n_layer, config.n_head, config.d_model) == (n_layer, n_head, d_model)
        assert config.d_model % config.n_head == 0
    assert {"tiny", "small", "medium"} <= set(PRESETS)
    with pytest.raises(ValueError):
        GPTConfig.from_preset("huge", vocab_size=74, block_size=64)
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=3, d_model=32)
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, d_model=32, dropout=1.0)
