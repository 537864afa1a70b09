"""What a trigger asks: its metadata parsed into a Query, profiles, label selectors, scale targets."""
