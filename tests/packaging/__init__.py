"""Tests of the image, the dev stack (compose.yaml, dev/stack.py) and what they share with the chart."""
