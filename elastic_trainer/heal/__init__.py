"""In-place healing: a fault costs the survivors neither their processes nor their state (``docs/design/heal-in-place.md``)."""
