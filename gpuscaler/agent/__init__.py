"""The node agent: collectors, attribution, the poll loop and its history, its settings and process."""
