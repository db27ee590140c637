"""What the SDK, the launcher and the aggregator share: run-directory layout and names."""
