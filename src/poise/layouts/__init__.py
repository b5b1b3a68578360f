"""Choices of parallel layout: SmartMoE's offline pool of hybrid layouts (`pool`), its
data-sensitive pricing (`price`) and online choice (`online`), and Parm's MP + EP + ESP schedules
with their analytic choice (`parm`)."""
