"""Passes that keep the graph in shape for the fusions and for Inductor: no-op elimination,
linear routing, cleanup, in-place lowering (always last)."""
