"""The ground floor: platform facts (CPU flags, dtypes, free ports) and the data contracts every
room shares (step plans and their results, the typed wire messages, the layer partition).
Nothing here imports anything else of pipefill; see ARCHITECTURE.md for the floors above."""
