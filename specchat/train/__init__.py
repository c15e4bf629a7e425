"""`python -m specchat train-draft`: trains an EAGLE-style draft head for a target
(docs/training.md)."""
