"""The torch reference of the embedding model (sentence-transformers' computation):
BertModel -> mean pooling over the attention mask -> L2 norm. Used by tools/export_onnx.py
(to export and to check parity) and tools/bench_embedding.py; never at serve time.
Needs the `export` extra (torch, transformers, safetensors).
"""

from __future__ import annotations

from ragline.models import ModelStore

SOURCE = "all-minilm-l6-v2"


def build_torch_model(store: ModelStore, source: str = SOURCE):
    import torch
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    config = BertConfig.from_json_file(str(store.file(source, "config.json")))
    bert = BertModel(config, add_pooling_layer=False)
    state = load_file(str(store.file(source, "model.safetensors")))
    state = {k.removeprefix("bert."): v for k, v in state.items()}
    missing, unexpected = bert.load_state_dict(state, strict=False)
    missing = [k for k in missing if "position_ids" not in k]
    unexpected = [k for k in unexpected if not k.startswith("pooler.") and "position_ids" not in k]
    if missing or unexpected:
        raise RuntimeError(
            f"weights do not fit BertModel: missing {missing}, unexpected {unexpected}"
        )
    bert.eval()

    class SentenceEncoder(torch.nn.Module):
        def __init__(self, encoder) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    return SentenceEncoder(bert).eval()
