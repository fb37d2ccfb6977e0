"""Planning without a model where it can: schedule, prefill rule, pass simulator, planner and its text."""
