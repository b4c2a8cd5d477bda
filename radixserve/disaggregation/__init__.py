"""Prefill/decode disaggregation (SGLang's `--disaggregation-mode prefill|decode`).

A prefill server computes a prompt's KV and first token and sends both to a decode server,
which generates the rest; SGLang's router (`--pd-disaggregation`) sends every request to both
with the same bootstrap room, which pairs them. `prefill.PrefillBootstrap` and
`decode.DecodePrealloc` are the two sides' request states inside the Scheduler;
`channel.ControlChannel` carries their messages; `transfer` moves the KV bytes (Mooncake's
transfer engine over TCP, or the fake backend). See docs/disaggregation.md.
"""
