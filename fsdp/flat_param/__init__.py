"""flat_param package of fsdp."""
