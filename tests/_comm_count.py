"""Counting collectives in tests: the benchmark's counter (patches ``torch.distributed``)."""

from benchmarks.comm import CommCounts, count_collectives, count_object_messages

__all__ = ["CommCounts", "count_collectives", "count_object_messages"]
