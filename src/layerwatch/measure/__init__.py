"""What a sampled step measures, and when: the parameters' and gradients' reductions
(``params``), Adam's state (``optimizer_state``), DeepSpeed ZeRO's partitions (``zero``), and the
reads of one sampled step taken to the host (``reads``)."""
