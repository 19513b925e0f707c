"""Building blocks of the gpt-oss model; each is tensor-parallel ready."""
