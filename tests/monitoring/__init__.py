"""promtool checks and unit tests of the alert rules the chart ships."""
