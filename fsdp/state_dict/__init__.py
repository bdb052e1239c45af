"""state_dict package of fsdp."""
