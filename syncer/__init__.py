"""The syncer: a streaming consumer that merges fragment deltas and applies the outer step."""
