"""Reading a run's logs back: ``layerwatch report`` (``report``), the notebook's DataFrames
(``notebook``), the rankings the tab and the report share (``rankings``)."""
