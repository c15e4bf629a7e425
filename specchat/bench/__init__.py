"""`python -m specchat bench`: Spec-Bench questions in several modes side by side."""
