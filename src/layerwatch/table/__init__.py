"""The layer table: shapes, parameters, bytes and MACs (``summary``), ``summarize(model, batch)``
(``summarize``), and MAC formulas beyond PyTorch's (``flops``)."""
