"""The randomized fault campaign (docs/campaign.md): a plan drawn from a seed,
played against a private world of real services and two workers, judged by
invariants at the end. ``scripts/campaign`` runs it; test_campaign.py runs a
fixed seed and the regression plans in the suite."""
