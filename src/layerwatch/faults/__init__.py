"""Faults between samples: the NaN/Inf sentinel on the gradients the optimizer steps with
(``sentinel``), its cadence and the ranks' vote on what it finds (``faults``), the bad step's
replay decided and agreed across ranks (``replay_agreement``) and run again with every probe
armed (``replay``), and what is said of a fault (``messages``)."""
