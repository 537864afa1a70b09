"""Engine signals answered from pods' metrics pages: which pods count, their values, the evaluation, the wanting."""
