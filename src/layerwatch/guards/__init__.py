"""What keeps layerwatch out of the way: hooks released with their engine and never run inside
compiled code (``hooks``); a failure warned once and skipped (``failures``)."""
