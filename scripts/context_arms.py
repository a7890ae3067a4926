"""Context-path candidates (issue 39, item 3), each trained the same way and scored by the state gain.

    .venv/bin/python scripts/context_arms.py "$(cat CONFIG.json)" base,fp32,fclr10,warm,massive

CONFIG.json: a TrainConfig as JSON (paths included; each arm saves to save_path-ARM). Arms: base (as
configured), fp32 (--autocast off), lrX (--lr X), fclrX (fc at X times the lr, its own Muon group), warm
(the draft layers from the verifier's last decoder layers, fc picking the top target layer, hidden_norm the
verifier's input norm), massive (fc's weights on channels whose RMS is over 10x their layer's median zeroed at
start). Each arm prints a ROW with tau and position 1 real/zeroed/other-sample/gain on 2,048 validation blocks.
An experiment: the candidates that are not settings are put in by replacing the trainer's builders here;
a winner becomes a TrainConfig setting. Reports figures; asserts nothing; CI never runs it.
"""

import json
import sys
import time
from dataclasses import replace

import torch

import dspark.train.loop as tl
import dspark.train.model as tm
from dspark.eval.config import TeacherForcedConfig
from dspark.eval.teacher_forced import run_eval
from dspark.train.config import TrainConfig

base_build_opt = tm.build_optimizers
base_build_model = tm.build_model


def fc_lr(scale):
    def build(model, cfg):
        opts = base_build_opt(model, cfg)
        fc = [p for n, p in model.named_parameters() if n.startswith("fc.")]
        ids = {id(p) for p in fc}
        for o in opts:
            for g in o.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in ids]
        muon = opts[0]
        muon.add_param_group({**{k: v for k, v in muon.param_groups[0].items() if k != "params"}, "params": fc,
                              "lr": cfg.lr * scale, "initial_lr": cfg.lr * scale})
        return opts
    return build

def verifier_layers(model, cfg):
    """Warm start: the draft layers from the verifier's last decoder layers, fc picking the top target layer."""
    from transformers import AutoModelForCausalLM
    v = AutoModelForCausalLM.from_pretrained(cfg.verifier_name_or_path, dtype=torch.float32)
    vl = v.model.layers
    n = len(model.layers)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            src = vl[len(vl) - n + i]
            sd = {k: t for k, t in src.state_dict().items()}
            missing = layer.load_state_dict(sd, strict=False)
        H = model.fc.out_features
        model.fc.weight.zero_()
        L = model.fc.in_features // H
        model.fc.weight[:, (L - 1) * H:] = torch.eye(H)
        model.hidden_norm.weight.copy_(vl[len(vl) - n].input_layernorm.weight)
    print("warm start, missing:", missing, file=sys.stderr)
    return model

def run(name, cfg, model_hook=None, opt_hook=None):
    tl.build_optimizers = opt_hook or base_build_opt
    if model_hook:
        tl.build_model = lambda c, p, d, v: model_hook(base_build_model(c, p, d, v), c)
    else:
        tl.build_model = base_build_model
    t = time.time()
    tl.Trainer(cfg, progress=False).fit()
    r, _ = run_eval(TeacherForcedConfig(checkpoint=cfg.save_path + "/latest", output=cfg.save_path + "/eval",
                                        split="val", max_anchors=2048))
    g, p = r["state_gain"], r["positions"]
    row = {"arm": name, "s": round(time.time() - t), "tau": round(r["tau_greedy"], 3),
           "gain_tau": round(g["tau_greedy"], 3),
           "p1": round(p[0]["greedy_match"], 3), "p1_zeroed": round(p[0]["zeroed_match"], 3),
           "p1_other": round(p[0]["other_sample_match"], 3), "gain_p1": round(g["positions"][0], 3),
           "gain_p2": round(g["positions"][1], 3)}
    print("ROW", json.dumps(row), flush=True)
    return row


def massive(model, cfg, ratio=10.0):
    """fc starts blind to the massive channels: their columns zeroed (RMS over 20 samples, position 0 left out)."""
    from dspark.connector.base import open_store

    s = open_store(cfg.store)
    layers = [s.manifest.target_layer_ids.index(i) for i in cfg.target_layer_ids]
    h = torch.cat([s.read(i).hidden_states[1:, layers].float() for i in s.sample_ids[:20]])  # [N, L, H]
    rms = h.pow(2).mean(0).sqrt()  # [L, H]
    big = rms > ratio * rms.median(dim=1, keepdim=True).values
    with torch.no_grad():
        model.fc.weight[:, big.reshape(-1)] = 0
    print("massive channels zeroed:", int(big.sum()), file=sys.stderr)
    return model


if __name__ == "__main__":
    base, arms = json.loads(sys.argv[1]), sys.argv[2].split(",")
    for arm in arms:
        cfg = TrainConfig.from_dict({**base, "save_path": base["save_path"] + "-" + arm})
        if arm == "base":
            run(arm, cfg)
        elif arm.startswith("fclr"):
            run(arm, cfg, opt_hook=fc_lr(float(arm[4:])))
        elif arm == "warm":
            run(arm, cfg, model_hook=verifier_layers)
        elif arm == "fp32":
            run(arm, replace(cfg, autocast="off"))
        elif arm.startswith("lr"):
            run(arm, replace(cfg, lr=float(arm[2:])))
        elif arm == "massive":
            run(arm, cfg, model_hook=massive)
        else:
            sys.exit(f"unknown arm {arm!r}: base, fp32, lrX, fclrX, warm or massive")

