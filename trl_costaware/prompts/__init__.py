"""The prompt stage (before generation, opt-in): which prompts a generation batch generates for, drawn from each
prompt's reward history with Horvitz–Thompson weights; and static subset selection (dropping expensive prompts
under a bias budget, before training)."""
