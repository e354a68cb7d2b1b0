//! The console against a real stack: every service in this process on
//! 127.0.0.1:0, real PostgreSQL and a real Kafka-protocol broker, each test
//! with its own prefixes. `handlers` speaks HTTP to the console; `browser`
//! drives a real headless Chromium through chromedriver.

mod browser;
mod handlers;
mod support;
mod webdriver;
