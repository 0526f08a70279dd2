-- A second database for the API's job records (MLflow owns the "mlflow" database).
CREATE DATABASE jobs OWNER vit;
