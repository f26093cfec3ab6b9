"""The encoder stage: media loading, preprocessing, batched encoding and its server."""
