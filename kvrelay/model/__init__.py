"""The gpt-oss model, its layers, MXFP4 support and the checkpoint loader."""
