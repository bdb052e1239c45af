"""init package of fsdp."""
