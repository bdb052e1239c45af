"""Packaging for ``fsdp``: a standalone FSDP1-style fully sharded data-parallel library."""

from pathlib import Path

from setuptools import find_packages, setup

_README = Path(__file__).with_name("README.md")

setup(
    name="fsdp",
    version="0.1.0",
    description="Fully sharded data parallel (FlatParameter / wrapper-module design) for PyTorch",
    long_description=_README.read_text(encoding="utf-8") if _README.exists() else "",
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    # Only the library: benchmarks/, examples/ and tests/ are tools run from a clone.
    packages=find_packages(include=["fsdp", "fsdp.*"]),
    package_data={"fsdp": ["py.typed"]},
    include_package_data=True,
    python_requires=">=3.10",
    # torch is pinned by the README / CI commands (``pip install torch==2.13.0`` first), so
    # installing fsdp never pulls another build. 2.11 is the oldest torch tried (the GPU
    # machine's 2.11.0+cu130, docs/results/gpu_h100_2026-11-24/: not every test passed there;
    # see README).
    # numpy: torch.distributed's object collectives and torch.distributed.checkpoint (used by
    # the optimizer/sharded state dicts and the demo's checkpoints) need it at run time, and
    # torch's wheel does not declare it.
    install_requires=["torch>=2.11", "typing-extensions>=4.0", "packaging>=21.0", "numpy"],
    extras_require={
        # ruff: the lint .ci/run runs (ruff.toml); mypy: its type check (pyproject.toml)
        "test": ["pytest>=7", "ruff==0.17.6", "mypy==2.4.1"],
        # The training stacks that tests/test_stacks_*.py run on fsdp (through
        # fsdp.redirect_torch_fsdp); pinned to the versions tested. About 65 MB and 20 s on top
        # of torch; see docs/stacks.md. transformers: tests/test_safetensors_export.py loads the
        # safetensors export with from_pretrained (about 10 s more to install, with tokenizers).
        "stacks": ["accelerate==1.15.0", "lightning==2.6.6", "transformers==5.24.0"],
    },
)
