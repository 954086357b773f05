"""Shared by the examples: load a zoo twin, or a random stand-in with a notice when it is absent."""

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.zoo import tokenizer as ZT


def load(name: str) -> HookedMDM:
    """The zoo twin if it is installed, else a random tiny model of the same interface (with a notice)."""
    try:
        return HookedMDM.from_pretrained(name)
    except MDMLensError as e:
        print(f"[notice] {name} is not available ({type(e).__name__}); using a RANDOM tiny model instead — "
              "numbers below are not the trained twin's.")
        cfg = MDMConfig(d_model=64, n_layers=4, n_heads=4, d_mlp=128, d_vocab=ZT.vocab_size(), n_ctx=128,
                        mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID, eos_token_id=ZT.EOS_ID,
                        pad_token_id=ZT.PAD_ID, attention="causal" if name.endswith("arm") else "bidirectional",
                        model_name=f"random:{name}", extra={"gen_length": 4})
        model = HookedMDM.from_config(cfg, seed=0, init_std=0.2)
        model.set_tokenizer(ZT.load_tokenizer())  # the probes read text with the model's own tokenizer
        return model
