"""Share the model: any snapshot to a Hugging Face GPT-2 folder, and a GPT-2 folder back in.

    python -m mingpt_ddp.export --snapshot runs/shakespeare_char/snapshots --out gpt2-shakespeare
    python -m mingpt_ddp.export --from-hf gpt2-shakespeare --out model.pt   # for sample.py
    python main.py trainer_config.init_from=gpt2-shakespeare ...            # fine-tune from it

gpt2.py maps the weights and settings both ways, tokenizer.py writes and reads the character
vocabulary as a tokenizer that transformers' AutoTokenizer loads; both need the `hf` extra
(pip install -e ".[hf]").
"""
