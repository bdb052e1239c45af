"""fsdp's benchmarks and measuring tools: not part of the installed package, run from the
repository root (``pip install -e .`` first). They import fsdp like any user.

``python -m benchmarks`` (CPU): fsdp against torch FSDP1, torch FSDP2, DDP and a local baseline
on ``--world-size`` local CPU ranks (gloo); step time, peak memory, bytes per step, checkpoint
times. ``python -m benchmarks --device cuda``: the GPU benchmark (world size 1; ``--offload``,
``--compile``). ``python -m benchmarks.validate_plan``: the memory planner's prediction against
a measured run. ``python benchmarks/gpu_run.py``: the prepared run for a GPU machine.
``docs/performance.md`` says what each figure means.

Modules:
    core: the models, the data, how each implementation wraps a model, the training step, and
        the report arithmetic, shared by the CPU and the GPU runs.
    config: the two benchmarks' configurations and command lines.
    cpu: the CPU benchmark's ranks. cuda: the GPU benchmark's runs.
    report: both benchmarks' summaries, tables, guards and targets.
    comm: counting collective calls and bytes. memory: peak live CPU tensor bytes.
    local_ranks: running a tool's ranks as local processes (the CPU benchmark and the
        planner's validation share it).
    validate_plan: the planner's validation run. gpu_run: the prepared GPU run.
"""
