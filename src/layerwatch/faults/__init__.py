"""Faults between samples: the NaN/Inf sentinel on the gradients the optimizer steps with
(``sentinel``), what its finding sets going (``faults``), and the bad step run again with every
probe armed (``replay``)."""
