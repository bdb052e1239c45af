"""runtime package of fsdp."""
