"""What the test tiers share: agents (real torchrun and launcher processes), waiting, servers."""
