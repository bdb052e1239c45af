"""Communication layer: collectives (one path for every backend), collective errors, groups.

The bottom layer above ``fsdp.api`` / ``fsdp._common``: it imports nothing else from fsdp, and
every other package reaches torch.distributed through it (see docs/design.md, "Layers").
"""
