"""Judgement: the health rules over a sampled step's rows (``alerts``), loss and gradient-norm
spikes between samples (``spikes``), the layers that grew most (``growth``), the loss's progress
(``progress``), and what one sampled step concluded (``findings``)."""
