"""Reading engine signals from the workload's own pods: the page's parser and the scraper."""
