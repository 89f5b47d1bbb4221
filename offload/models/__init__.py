"""Models and data for the demo: a small GPT and a character-level text corpus."""
from offload.models.gpt import GPT, GPTConfig
from offload.models.text import CharTokenizer, TextWindows, load_corpus, split_tokens

__all__ = ["GPT", "GPTConfig", "CharTokenizer", "TextWindows", "load_corpus", "split_tokens"]
