"""specdec_tools: offline tools around the engine, not part of the service.

- `specdec_tools.distill`: draft distillation (`specdec-distill`, `python -m specdec_tools.distill`),
  a standalone draft model or an EAGLE-style draft for a target, exported as a loadable checkpoint;
- `specdec_tools.bench`: the engine benchmark (`specdec-bench`, `python -m specdec_tools.bench`),
  plain decoding vs each proposer on the demo target.

Dependencies point one way: this package imports `specdec`; `specdec`, `deployments` and
`serve_app` never import it.
"""
