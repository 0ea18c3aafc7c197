"""The distributed layer: ranks, sharded tensors and their clean names (``sharding``), how the
ranks agree (``agreement``), pipeline stages (``stages``)."""
