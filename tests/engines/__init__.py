"""Engine signals: the page parser, one pod's value, which pods count, and trigger metadata."""
