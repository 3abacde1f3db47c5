"""The ring's value types, the lowest floor above wire/: the plan, the step messages, KV cost and sampling parameters. No MLX compute, no I/O."""
