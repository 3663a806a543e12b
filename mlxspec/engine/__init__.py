"""The round loop and what it needs above the drafters and pacers: ``stream_generate``/``generate``, the
pipelined plain steps, the argument checks, and the session that turns specs into a ready target and
drafter."""
