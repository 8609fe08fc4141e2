"""The profile-driven pipeline: build profiles, the capacity and provenance they are checked against, the
settings a profile turns into, and the checkpoint -> engine -> Triton stages with their fingerprints."""
