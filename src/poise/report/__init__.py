"""Pictures and pages: plots (matplotlib, Agg backend) and the HTML report."""
