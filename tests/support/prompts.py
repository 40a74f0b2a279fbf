"""The prompts the shared stores are ingested over (tests/conftest.py's fixtures)."""

# Prompts of different lengths so batches are padded; one repeats a word to vary anchors.
PROMPTS = [
    "The capital of France is Paris.",
    "One two three four five six seven eight nine ten.",
    "the the the the",
    "A quick brown fox jumps over the lazy dog near the river bank today.",
    "She sells sea shells by the sea shore.",
    "Water boils at one hundred degrees.",
]
