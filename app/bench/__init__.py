"""`moechat bench …`: benchmarks, kept out of the product modules."""
