"""A Hugging Face ``Trainer`` run that never imports TraceML (unless ``--callback``).

A 1-layer GPT-2 built from a config (no download) learns a synthetic token dataset for
``--steps`` optimizer steps (``max_steps``), gloo DDP on CPU under torchrun. With
``--callback`` the Trainer gets ``traceml.integrations.hf.TraceMLCallback``.
"""

import torch
from synthetic import arguments
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    args = arguments(8, framework=True).parse_args()
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=16)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    callbacks = []
    if args.callback:
        from traceml.integrations.hf import TraceMLCallback

        callbacks.append(TraceMLCallback())
    trainer = Trainer(
        model=model, args=training, train_dataset=Tokens(64, 16, 128), callbacks=callbacks
    )
    trainer.train()


if __name__ == "__main__":
    main()
