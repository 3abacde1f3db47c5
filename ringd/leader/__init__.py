"""The leader: the schedule of micro-batches (sans-I/O), its asyncio shell the engine, admission, prefix reuse and the draft model."""
