"""Write a tiny OPT model and a word-level tokenizer to a folder (DeepSpeed-Chat's --model_name_or_path),
built from a config and a seed: nothing is downloaded. ``python tiny_opt.py DIR``."""
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(61)]


def make_tiny_opt(path: str) -> None:
    vocab = {"<pad>": 0, "<unk>": 1, "<|endoftext|>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                       num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                       pad_token_id=0, bos_token_id=2, eos_token_id=2, dropout=0.0, attention_dropout=0.0)
    OPTForCausalLM(config).save_pretrained(path)


if __name__ == "__main__":
    make_tiny_opt(sys.argv[1])
