"""The harness layer: what each agent CLI needs in a cell (profiles), a scripted model endpoint to
run them against (:mod:`.mockmodel`), and the proof on this machine (:mod:`.check`)."""
